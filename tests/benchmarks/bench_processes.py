"""A ``map_blocks`` function written in plain Python: serial, threads and worker processes.

A per-row Python loop holds the GIL, so the threads executor runs it one block at a
time; the ``"processes"`` executor runs it in a pool of worker processes, one per core.
The target (issue 11): on 2 cores, ``processes`` >= 1.7x ``serial``, with ``threads``
measured in the same run.

The data: a float32 ``[N, 8]`` ``.npy`` (default 200,000 rows, 6.4 MB) generated in a
temporary folder and removed at the end, read two ways with 5,000-row blocks:
``tw.from_array`` over the file loaded into RAM (the array travels inside the program,
by value, once per worker) and ``tw.from_npy`` (workers read their rows by path). The
function, :func:`per_row`, standardises each row, squashes it with ``tanh`` and takes a
softmax, with Python floats (about 5 us a row). Two results of it:

* ``.sum(axis=0)``: a reduction; each worker sends back a partial of 8 values a block;
* ``.compute()``: the whole array; each worker sends its 160 KB block through the pipe
  and the driver copies it into the result.

Everything runs in one child process (``bench_processes.py --child PATH ROUNDS``), so the
process pool starts inside the measurement. First, per case (source x result), one
warm-up compute on each executor; the one on ``processes`` is reported as the case's
*first* compute (the very first starts the pool, the others send their program to the
workers). Then ``ROUNDS`` rounds, each running ``[serial, threads, processes]`` on every
case in turn, so that a burst of other work falls on all cases alike. A round's ratios
are ``serial / threads`` and ``serial / processes`` of that round's times; the table
shows the median over the rounds and the range (min-max). Every result is checked
against the serial one (the computed array bitwise, a sum to 1e-6 relative), and the
serial results of both sources against each other.

On a machine shared with other work, two workers get less than two cores and the ratio
drops with that work, so it is measured alongside: the 1-minute load average
(``os.getloadavg()``, this benchmark's own processes included) at the start and after
every round, and per compute the cores the rest of the machine used meanwhile (busy
time from ``/proc/stat`` minus this benchmark's CPU time). ``--quiet CORES`` makes each
round wait first (up to 2 min) until other work uses under ``CORES`` cores.

Also per compute: the CPU seconds of the driver (``time.process_time``) and of the
worker processes (``/proc/<pid>/stat``), and the seconds the block tasks ran (as the
engine reports them, in the worker for ``processes``): a worker's share of a core while
it ran tasks, and serial CPU over the busiest worker's CPU (the ratio each process
having a core of its own would give, before gaps between tasks). ``--profile`` adds
where the driver's time goes on ``processes`` (``cProfile`` of the scheduler's thread
for one compute per case), the fixed cost of one block task (a cheap function on the
same blocks, one worker), and the cost of pickling a result block.

``python tests/benchmarks/bench_processes.py [--rows 200000] [--rounds 5] [--profile]
[--quiet CORES] [--json figures.json]`` prints the figures and a table of the targets (PASS/MISS; exit
status 1 on a MISS only with ``--strict``). ``make bench`` runs the pytest-benchmark test
below on 20,000 rows (``TIERFLOW_BENCH_PROCESSES_ROWS``) and one round: it asserts that
every executor ran and gave the serial results, and records the figures in
``extra_info``; the speed target is not asserted there (it depends on the cores and the
load).
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pickle
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import emit, make_npy, run_sampled, save_figures, span, verdict

from tierflow.engine.runtime.executors import ProcessExecutor, default_workers

WIDTH = 8
ROWS = 200_000
BLOCK_ROWS = 5_000
ROUNDS = 5
TARGET = 1.7  # processes / serial, 2 cores
SUM_RTOL = 1e-6  # a sum's partials may be combined in another order
TIMEOUT_S = 1800.0
EXECUTORS = ("serial", "threads", "processes")
SOURCES = ("array", "npy")
RESULTS = ("sum", "compute")
PROFILE_LINES = 14
QUIET_TIMEOUT_S = 120.0  # --quiet: longest wait for the machine before a round

BENCH_ROWS = int(os.environ.get("TIERFLOW_BENCH_PROCESSES_ROWS", "20000"))


def per_row(block: np.ndarray) -> np.ndarray:
    """Each row standardised, squashed with tanh and turned into a softmax, in Python
    floats: the GIL is held the whole time."""
    out = np.empty(block.shape, dtype=np.float32)
    for i in range(block.shape[0]):
        row = block[i].tolist()
        n = len(row)
        mean = sum(row) / n
        std = math.sqrt(sum((v - mean) * (v - mean) for v in row) / n + 1e-6)
        z = [math.tanh((v - mean) / std) for v in row]
        top = max(z)
        e = [math.exp(v - top) for v in z]
        total = sum(e)
        out[i] = [v / total for v in e]
    return out


def plus_one(block: np.ndarray) -> np.ndarray:
    """A cheap function: what a block task costs besides its work."""
    return block + 1


# -- the child side: every measurement in one process -------------------------------------


class _Tasks:
    """A callback adding up the seconds the block tasks ran (in the worker, on
    ``processes``), as the engine reports them."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.blocks = 0

    def start(self, event: Any) -> None:
        return None

    def task_done(self, event: Any) -> None:
        if event.name.startswith("block "):
            self.busy += event.seconds
            self.blocks += 1

    def finish(self, event: Any) -> None:
        return None


def _cpu_seconds(pids: Sequence[int]) -> dict[int, float]:
    """User + system CPU seconds each of the processes ``pids`` has used so far
    (``/proc/<pid>/stat``; a process that is gone is left out)."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[pid] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return found


def _machine_cpu() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy (all cores, steal left out) and
    stolen by the hypervisor, from the first line of ``/proc/stat``."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq) / ticks, steal / ticks


def _timed(array: Any, executor: str) -> tuple[Any, dict[str, Any]]:
    """One compute of ``array`` on ``executor``: its result and figures. ``worker_cpu``
    counts the workers that are there at the end (a pool started by this compute too)."""
    pool = ProcessExecutor()  # starts nothing; the pool of its size is shared
    shipped = pool.shipped
    tasks = _Tasks()
    before = _cpu_seconds(pool.worker_pids())
    busy, stolen = _machine_cpu()
    cpu = time.process_time()
    start = time.perf_counter()
    result = array.compute(executor=executor, progress=False, callbacks=tasks)
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    after = _cpu_seconds(pool.worker_pids())
    used = [t - before.get(pid, 0.0) for pid, t in after.items()]
    busy_after, stolen_after = _machine_cpu()
    others = max(0.0, busy_after - busy - cpu - sum(used))
    figures = {
        "seconds": seconds,
        "driver_cpu": cpu,
        "worker_cpu": sum(used),
        "busiest_worker_cpu": max(used, default=0.0),
        "busy": tasks.busy,
        "blocks": tasks.blocks,
        "shipped": pool.shipped - shipped,  # programs sent to workers
        "other_cores": others / seconds,  # other work on the machine meanwhile, in cores
        "steal_cores": (stolen_after - stolen) / seconds,
    }
    return result, figures


def _difference(result: Any, reference: Any, kind: str) -> float:
    """Largest relative difference of ``result`` from ``reference`` (0.0: equal)."""
    result, reference = np.asarray(result), np.asarray(reference)
    if result.shape != reference.shape:
        return math.inf
    if kind == "compute":
        return 0.0 if np.array_equal(result, reference) else math.inf
    scale = np.maximum(np.abs(reference.astype(np.float64)), 1e-300)
    return float(np.max(np.abs(result.astype(np.float64) - reference) / scale))


def _load() -> float:
    return os.getloadavg()[0]


def _arrays(path: str) -> dict[str, Any]:
    import tierflow as tw

    in_ram = np.load(path)
    return {
        "array": tw.from_array(in_ram, rows=BLOCK_ROWS),
        "npy": tw.from_npy(path, rows=BLOCK_ROWS),
    }


def _lazy(source: Any, result: str, fn: Callable[[np.ndarray], np.ndarray] = per_row) -> Any:
    mapped = source.map_blocks(fn, dtype=np.float32, row_shape=(WIDTH,))
    return mapped.sum(axis=0) if result == "sum" else mapped


def wait_quiet(limit: float, timeout: float) -> tuple[float, float]:
    """Wait until the rest of the machine uses under ``limit`` cores (measured over a
    second while this process sleeps), at most ``timeout`` seconds; returns the seconds
    waited and the cores last measured."""
    start = time.monotonic()
    while True:
        busy, _ = _machine_cpu()
        time.sleep(1.0)
        cores = _machine_cpu()[0] - busy
        waited = time.monotonic() - start
        if cores < limit or waited >= timeout:
            return waited, cores


def measure(path: str, rounds: int, quiet: float | None = None) -> dict[str, Any]:
    """Each case's warm-up computes (one per executor), then ``rounds`` rounds, each of
    ``[serial, threads, processes]`` on every case in turn (so that a burst of other work
    on the machine falls on all cases alike). With ``quiet``, each round waits first until
    the rest of the machine uses under that many cores (:func:`wait_quiet`)."""
    arrays = _arrays(path)
    names = [f"{source}/{result}" for source in SOURCES for result in RESULTS]
    lazies = {n: _lazy(arrays[n.split("/")[0]], n.split("/")[1]) for n in names}
    cases: dict[str, Any] = {}
    references: dict[str, np.ndarray] = {}
    for name, lazy in lazies.items():
        reference, warm_serial = _timed(lazy, "serial")
        _, warm_threads = _timed(lazy, "threads")
        got, first = _timed(lazy, "processes")
        references[name] = np.asarray(reference)
        cases[name] = {
            "warm_serial": warm_serial,
            "warm_threads": warm_threads,
            "first": first,
            "rounds": [],
            "difference": {"processes": _difference(got, reference, name.split("/")[1])},
        }
    waits = []
    for _ in range(rounds):
        if quiet is not None:
            waits.append(wait_quiet(quiet, QUIET_TIMEOUT_S))
        for name, lazy in lazies.items():
            case = cases[name]
            row: dict[str, Any] = {}
            for executor in EXECUTORS:
                got, row[executor] = _timed(lazy, executor)
                found = _difference(got, references[name], name.split("/")[1])
                case["difference"][executor] = max(case["difference"].get(executor, 0.0), found)
            row["load"] = _load()
            case["rounds"].append(row)
    sources_agree = {
        result: bool(np.array_equal(references[f"array/{result}"], references[f"npy/{result}"]))
        for result in RESULTS
    }
    return {"cases": cases, "sources_agree": sources_agree, "quiet_waits": waits}


def profile(path: str) -> dict[str, Any]:
    """Where the time goes on ``processes``: the driver's profile of one compute per
    case, a block task's fixed cost, and the cost of pickling a result block."""
    arrays = _arrays(path)
    out: dict[str, Any] = {"driver": {}}
    for source in SOURCES:
        for result in RESULTS:
            lazy = _lazy(arrays[source], result)
            lazy.compute(executor="processes", progress=False)  # its program shipped first
            profiler = cProfile.Profile()
            profiler.enable()
            lazy.compute(executor="processes", progress=False)
            profiler.disable()
            out["driver"][f"{source}/{result}"] = _top(profiler)
    # Fixed cost of a block task: a cheap function on the same blocks, one worker (on
    # processes) against the serial executor; medians of 5, after a warm-up.
    fixed: dict[str, float] = {}
    for source in SOURCES:
        lazy = _lazy(arrays[source], "sum", plus_one)
        blocks = arrays[source].nblocks
        for executor, workers in (("serial", None), ("processes", 1)):
            lazy.compute(executor=executor, workers=workers, progress=False)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                lazy.compute(executor=executor, workers=workers, progress=False)
                times.append(time.perf_counter() - start)
            fixed[f"{source}/{executor}"] = statistics.median(times) / blocks
    out["per_task"] = fixed
    block = np.asarray(_lazy(arrays["array"], "compute").compute(progress=False))[:BLOCK_ROWS]
    start = time.perf_counter()
    for _ in range(100):
        pickle.loads(pickle.dumps(block, protocol=pickle.HIGHEST_PROTOCOL))
    out["pickle_block"] = (time.perf_counter() - start) / 100
    return out


def _top(profiler: cProfile.Profile) -> list[tuple[str, int, float, float]]:
    """The driver's most expensive functions by their own time, leaving out the wait
    for results (``(function, calls, own seconds, cumulative seconds)``)."""
    stats: Any = pstats.Stats(profiler)
    rows = []
    for (filename, line, function), (_, calls, own, cumulative, _) in stats.stats.items():
        if function == "<method 'acquire' of '_thread.lock' objects>":
            continue  # the scheduler waiting for results
        rows.append((f"{Path(filename).name}:{line}({function})", calls, own, cumulative))
    rows.sort(key=lambda r: r[2], reverse=True)
    return rows[:PROFILE_LINES]


def child_main(path: str, rounds: int, with_profile: bool, quiet: float | None) -> None:
    figures: dict[str, Any] = {
        "load_start": os.getloadavg(),
        "cores": os.cpu_count(),
        "workers": default_workers(),
    }
    figures.update(measure(path, rounds, quiet))
    if with_profile:
        figures["profile"] = profile(path)
    figures["load_end"] = os.getloadavg()
    emit(figures)


# -- the parent side ----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One line of the final table: the median ratio of processes over serial."""

    what: str
    value: float | None
    target: float

    @property
    def verdict(self) -> str:
        return verdict(self.value, self.target)


def run_all(
    rows: int,
    folder: Path,
    *,
    rounds: int = ROUNDS,
    with_profile: bool = False,
    quiet: float | None = None,
) -> dict[str, Any]:
    """Generate the file in ``folder`` and run the measurement in a child process."""
    path = make_npy(folder / "x.npy", rows, WIDTH, block_rows=BLOCK_ROWS * 20)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(path), str(rounds)]
    if with_profile:
        cmd.append("--profile")
    if quiet is not None:
        cmd += ["--quiet", str(quiet)]
    env = dict(os.environ)
    env.pop("TIERFLOW_CACHE", None)
    env["TIERFLOW_SPILL_DIR"] = str(folder / "spill")
    run = run_sampled(cmd, timeout=TIMEOUT_S, env=env)
    report = run.figures()
    report.update(rows=rows, rounds=rounds, returncode=run.returncode)
    if run.returncode != 0 or "cases" not in report:
        report["error"] = run.stderr[-3000:] or f"exit status {run.returncode}, no output"
    return report


def ratios(case: dict[str, Any], executor: str) -> list[float]:
    """``serial / executor`` of each round."""
    return [r["serial"]["seconds"] / r[executor]["seconds"] for r in case["rounds"]]


def targets(report: dict[str, Any]) -> list[Target]:
    rows = []
    for name, case in report.get("cases", {}).items():
        values = ratios(case, "processes")
        value = statistics.median(values) if values else None
        rows.append(Target(f"{name}: processes / serial (median)", value, TARGET))
    return rows


def print_report(report: dict[str, Any], rows: Sequence[Target]) -> None:
    if "error" in report:
        print(f"FAILED: {report['error']}")
    load = report.get("load_start", [0, 0, 0])
    print(
        f"{report['rows']:,} rows of {WIDTH} float32 in {BLOCK_ROWS:,}-row blocks; "
        f"{report.get('workers')} workers on {report.get('cores')} cores; "
        f"{report['rounds']} rounds of [serial, threads, processes]"
    )
    print(f"load average at the start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min)")
    print(
        "  ratios: serial / executor per round, median (min-max); seconds: medians; other"
        " work: cores the rest of the machine used while processes ran (median); load: the"
        " 1-minute load average after each round (ours included)"
    )
    print(
        f"  {'case':<16}{'serial s':>9}{'threads':>20}{'processes':>20}"
        f"{'first proc. s':>15}{'later s':>9}{'other work':>12}{'load':>12}"
    )
    for name, case in report.get("cases", {}).items():
        rounds = case["rounds"]
        serial = statistics.median(r["serial"]["seconds"] for r in rounds)
        later = statistics.median(r["processes"]["seconds"] for r in rounds)
        others = statistics.median(r["processes"].get("other_cores", 0.0) for r in rounds)
        loads = [r["load"] for r in rounds]
        print(
            f"  {name:<16}{serial:>9.3f}{span(ratios(case, 'threads')):>20}"
            f"{span(ratios(case, 'processes')):>20}{case['first']['seconds']:>15.3f}"
            f"{later:>9.3f}{others:>12.2f}{min(loads):>7.2f}-{max(loads):<4.2f}"
        )
    print()
    print(
        "  CPU seconds per compute (medians): the driver's, and the workers' on processes;"
        " a worker's share of a core while its tasks ran (CPU / task seconds); serial CPU"
        " over the busiest worker's CPU (the ratio if each process had a core of its own)"
    )
    print(
        f"  {'case':<16}{'serial':>8}{'threads':>9}{'processes':>14}{'share':>7}"
        f"{'CPU ratio':>11}{'programs sent again':>21}"
    )
    for name, case in report.get("cases", {}).items():
        rounds = case["rounds"]

        def median(executor: str, key: str, rounds: list[Any] = rounds) -> float:
            return statistics.median(r[executor][key] for r in rounds)

        procs = [r["processes"] for r in rounds]
        share = statistics.median(p["worker_cpu"] / p["busy"] for p in procs if p["busy"] > 0)
        cpu_ratio = statistics.median(
            r["serial"]["driver_cpu"] / r["processes"]["busiest_worker_cpu"]
            for r in rounds
            if r["processes"]["busiest_worker_cpu"] > 0
        )
        both = f"{median('processes', 'driver_cpu'):.2f}+{median('processes', 'worker_cpu'):.2f}"
        print(
            f"  {name:<16}{median('serial', 'driver_cpu'):>8.2f}"
            f"{median('threads', 'driver_cpu'):>9.2f}{both:>14}{share:>7.2f}"
            f"{cpu_ratio:>10.2f}x{sum(p['shipped'] for p in procs):>21}"
        )
    print()
    for name, case in report.get("cases", {}).items():
        first = case["first"]
        print(
            f"  {name:<16}first compute on processes: {first['seconds']:.3f} s, "
            f"programs sent {first.get('shipped')}; differences from serial "
            + ", ".join(f"{k} {v:.1e}" for k, v in case["difference"].items())
        )
    waits = report.get("quiet_waits") or []
    if waits:
        print(
            "  waits for a quiet machine before each round (s, other work in cores): "
            + ", ".join(f"{w:.0f} ({c:.2f})" for w, c in waits)
        )
    agree = report.get("sources_agree", {})
    print(f"  serial results of from_array and from_npy equal: {agree}")
    if "profile" in report:
        print_profile(report["profile"])
    print()
    for t in rows:
        value = "-" if t.value is None else f"{t.value:.2f}"
        print(f"  {t.verdict:<5} {t.what:<46} {value:>6}  (target >= {t.target})")
    end = report.get("load_end")
    if end:
        print(f"load average at the end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")


def print_profile(found: dict[str, Any]) -> None:
    print()
    print("  where the driver's time goes on processes (one compute; waiting for results left out)")
    for name, top in found["driver"].items():
        total = sum(own for _, _, own, _ in top)
        print(f"  {name}: the top {len(top)} functions, {total * 1e3:.1f} ms of own time")
        for where, calls, own, cumulative in top:
            print(
                f"    {own * 1e3:8.2f} ms own {cumulative * 1e3:8.2f} ms cum. {calls:>6}  {where}"
            )
    per_task = found["per_task"]
    print(
        "  fixed cost of a block task (block + 1, one worker): "
        + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in per_task.items())
    )
    print(
        f"  pickle + unpickle of a {BLOCK_ROWS:,}-row result block: {found['pickle_block'] * 1e6:.0f} us"
    )


def main(argv: Sequence[str] | None = None) -> int:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rows", type=int, default=ROWS, help="rows of the generated file")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of each executor")
    parser.add_argument("--profile", action="store_true", help="also show where time goes")
    parser.add_argument(
        "--quiet",
        type=float,
        metavar="CORES",
        help="before each round, wait (up to 2 min) until other work uses under CORES cores",
    )
    parser.add_argument("--dir", help="folder for the file (default: a temp folder)")
    parser.add_argument("--json", help="write the figures (JSON) here")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "ROUNDS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        path, rounds = args.child
        child_main(path, int(rounds), args.profile, args.quiet)
        return 0
    folder = Path(tempfile.mkdtemp(prefix="bench-processes-", dir=args.dir))
    try:
        report = run_all(
            args.rows, folder, rounds=args.rounds, with_profile=args.profile, quiet=args.quiet
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows = targets(report)
    print_report(report, rows)
    missed = save_figures(report, rows, args.json) or "error" in report
    return 1 if missed and args.strict else 0


# -- pytest-benchmark ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    where = tmp_path_factory.mktemp("bench-processes")
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_plain_python_map_blocks_on_serial_threads_and_processes(
    benchmark: Any, folder: Path
) -> None:
    benchmark.group = "engine: plain-Python functions"
    report = benchmark.pedantic(
        run_all, args=(BENCH_ROWS, folder), kwargs={"rounds": 1}, rounds=1, iterations=1
    )
    rows = targets(report)
    print_report(report, rows)
    assert "error" not in report, report["error"]
    benchmark.extra_info["load_start"] = report["load_start"]
    benchmark.extra_info["ratios"] = {
        name: {e: ratios(case, e) for e in ("threads", "processes")}
        for name, case in report["cases"].items()
    }
    assert set(report["cases"]) == {f"{s}/{r}" for s in SOURCES for r in RESULTS}
    for name, case in report["cases"].items():
        assert all(d <= SUM_RTOL for d in case["difference"].values()), (name, case["difference"])
        blocks = -(-BENCH_ROWS // BLOCK_ROWS)
        for r in case["rounds"]:
            assert all(r[e]["blocks"] == blocks for e in EXECUTORS), (name, r)
            assert r["processes"]["worker_cpu"] > 0 or r["processes"]["busy"] > 0, (name, r)
    assert all(report["sources_agree"].values()), report["sources_agree"]


if __name__ == "__main__":
    sys.exit(main())
