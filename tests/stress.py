"""Run the tests that race (clusters, worker processes, computes at once) many times in
a row, each run under a watchdog: ``make stress`` (``STRESS_RUNS=20`` by default).

A flaky test fails one run in many, and a hang stops a run for good, so one green run
says little. Each run is a fresh ``pytest`` process over :data:`FILES`, with output not
captured (worker processes write to the same log) and its log kept in ``.stress/``.
A run still going after ``--watchdog`` seconds is stopped with ``SIGABRT``, which makes
Python print every thread's stack (faulthandler: pytest turns it on, and so do
tierflow's worker processes), so the hang names itself in the log; then its process
group is killed. The first failed or stopped run ends the loop, its log's path printed.

    python tests/stress.py --runs 20 [--watchdog 900] [pytest files or options ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
FILES = [
    "tests/engine/runtime/test_clusters.py",
    "tests/engine/runtime/test_cluster_executors.py",
    "tests/engine/runtime/test_cluster_packs.py",
    "tests/engine/runtime/test_cluster_stragglers.py",
    "tests/engine/runtime/test_processes.py",
    "tests/engine/runtime/test_concurrency.py",
]
GRACE = 15.0  # seconds between the SIGABRT (stacks printed) and the kill


def _python_descendants(pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        try:
            if "python" in os.path.basename(child.exe()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Ask ``process`` and its Python descendants for their stacks, then kill them all."""
    children = _python_descendants(process.pid)  # before it dies and they are orphaned
    for child in children:
        with contextlib.suppress(OSError, psutil.Error):
            child.send_signal(signal.SIGABRT)
    with contextlib.suppress(OSError):
        process.send_signal(signal.SIGABRT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(GRACE)
    for child in children:
        with contextlib.suppress(OSError, psutil.Error):
            child.kill()
    with contextlib.suppress(OSError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_once(number: int, args: list[str], watchdog: float, logs: Path) -> tuple[str, float]:
    """One pytest run; ``("passed" | "failed (rc N)" | "hung", seconds)``."""
    log = logs / f"run-{number:03d}.log"
    env = {**os.environ, "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")}
    command = [sys.executable, "-m", "pytest", "-q", "-s", *args]
    start = time.monotonic()
    with open(log, "wb") as out:
        out.write((" ".join(command) + "\n").encode())
        out.flush()
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            rc = process.wait(watchdog)
        except subprocess.TimeoutExpired:
            _stop(process)
            return "hung", time.monotonic() - start
    seconds = time.monotonic() - start
    return ("passed" if rc == 0 else f"failed (rc {rc})"), seconds


def _summary(log: Path) -> str:
    """pytest's last line of counts in ``log``, or what its absence means."""
    text = log.read_text(errors="replace")
    found = re.findall(r"^=* ?(\d+ (?:passed|failed|error).*?) ?=*$", text, re.MULTILINE)
    if found:
        return found[-1]
    return "no summary: the test process ended before pytest could print one (killed or exited)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs in a row (default 20)")
    parser.add_argument(
        "--watchdog", type=float, default=900.0, help="seconds before a run counts as hung"
    )
    parser.add_argument("--logs", default=str(ROOT / ".stress"), help="folder for the logs")
    options, rest = parser.parse_known_args(argv)
    args = rest or FILES
    logs = Path(options.logs)
    logs.mkdir(parents=True, exist_ok=True)
    times = []
    for number in range(1, options.runs + 1):
        outcome, seconds = run_once(number, args, options.watchdog, logs)
        times.append(seconds)
        print(f"run {number}/{options.runs}: {outcome} in {seconds:.0f} s", flush=True)
        if outcome != "passed":
            log = logs / f"run-{number:03d}.log"
            print(f"stopped: {_summary(log)}; see {log}", flush=True)
            return 1
    print(
        f"{options.runs} runs passed in a row: {min(times):.0f}-{max(times):.0f} s each, "
        f"{sum(times) / 60:.1f} min in all"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
