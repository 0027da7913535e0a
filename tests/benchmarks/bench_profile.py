"""What profiling costs, on and off; and the profile picture of the 4 GB pipeline.

1. **Off.** The same computes with the profile hooks in the scheduler but no profile
   (this tree), and without the hooks at all (``--baseline DIR``: a tree of tierflow
   from before them, e.g. ``git archive <commit> tierflow | tar -x -C DIR``). Each
   runs in its own child process (``PYTHONPATH`` pointing at its tree), alternating,
   best of ``--repeat`` runs each, every run the best of 5 computes after a warm-up:

   * ``tiny``: 20,000 blocks of 1,000 rows through ``((x + 1) * 2 - 3).sum(axis=0)``
     on the serial executor (the scheduler's cost per task at its most visible: a task
     takes about 30 us);
   * ``stats``: ``x.mean(axis=0), x.std(axis=0)`` of a ``[10,000,000, 8]`` float32
     array in RAM (320 MB), 80 blocks (tasks of milliseconds), on threads.

   Wall and CPU time (every thread of the child) are both kept; CPU time is the steadier
   on a shared machine.

   The ratio off / baseline is what profiling costs when it is off; on / off what it
   costs when on (a record per task and the sampler thread). The baseline runs twice
   per round (``base`` first, ``base2`` last): base2 / base is the noise between two
   equal trees on this machine, the yardstick for the others.
2. **The picture** (``--picture PNG``): a float32 ``[N, 8]`` ``.npy`` of ``--size-gb``
   (default 4, i.e. 125,000,000 rows) in a temporary folder; with ``--budget`` (default
   1 GB) and ``tw.profile()``: ``mean, std = tw.compute(x.mean(axis=0), x.std(axis=0))``
   then ``((x - mean) / std).to_npy(out)``; the plot saved as the PNG and the summary
   printed. Files bigger than 0.5 GB: run it under the benchmark lock.

``python tests/benchmarks/bench_profile.py [--baseline DIR] [--repeat 3] [--picture
docs/img/profile.png --size-gb 4 --budget 1GB]``. ``make bench`` runs the small
pytest-benchmark case below (in this process: on vs off only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

GB = 10**9
ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ("tiny", "stats")


def _arrays(kind: str, scale: float = 1.0) -> tuple[Any, Any]:
    """The array and the computes of workload ``kind`` (see the module docstring)."""
    import tierflow as tw

    if kind == "tiny":
        blocks = max(10, int(20_000 * scale))
        a = np.random.default_rng(0).random((blocks * 1_000, 1), dtype=np.float32)
        x = tw.from_array(a, rows=1_000)
        return x, (((x + 1) * 2 - 3).sum(axis=0),)
    rows = max(125_000, int(10_000_000 * scale))
    a = np.random.default_rng(0).random((rows, 8), dtype=np.float32)
    x = tw.from_array(a, rows=125_000)
    return x, (x.mean(axis=0), x.std(axis=0))


def best_of(kind: str, profile: bool, runs: int = 5, scale: float = 1.0) -> tuple[float, float]:
    """Wall and CPU seconds (this process, every thread) of the fastest of ``runs``
    computes of ``kind``, after a warm-up. CPU time is the steadier figure on a machine
    that other work shares."""
    import tierflow as tw

    _, results = _arrays(kind, scale)
    # The tiny tasks run serially: the scheduler's own cost per task, without two
    # threads' turns at the GIL (whose noise on a shared machine is larger than it).
    options: dict[str, Any] = {"progress": False, "executor": "serial" if kind == "tiny" else None}
    if profile:
        options["profile"] = True
    tw.compute(*results, **options)
    wall = cpu = float("inf")
    for _ in range(runs):
        start, start_cpu = time.perf_counter(), time.process_time()
        tw.compute(*results, **options)
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def child(kind: str, profile: bool) -> None:
    wall, cpu = best_of(kind, profile)
    print(json.dumps({"kind": kind, "profile": profile, "wall": wall, "cpu": cpu}))


def run_child(kind: str, profile: bool, tree: Path) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, __file__, "--child", kind] + (["--on"] if profile else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return float(figures["wall"]), float(figures["cpu"])


def overhead(baseline: Path | None, repeat: int) -> dict[str, dict[str, float]]:
    """Best wall and CPU seconds per workload: ``off`` (this tree), ``on``, and ``base``
    (the tree without the hooks, when given), and the ratios."""
    figures: dict[str, dict[str, float]] = {}
    for kind in WORKLOADS:
        seen: dict[str, float] = {}
        for _ in range(repeat):
            runs = [("off", False, ROOT), ("on", True, ROOT)]
            if baseline is not None:  # twice: base2 / base is the noise between equals
                runs = [("base", False, baseline), *runs, ("base2", False, baseline)]
            for name, on, tree in runs:
                wall, cpu = run_child(kind, on, tree)
                seen[f"{name}_wall"] = min(seen.get(f"{name}_wall", float("inf")), wall)
                seen[f"{name}_cpu"] = min(seen.get(f"{name}_cpu", float("inf")), cpu)
        for clock in ("wall", "cpu"):
            if baseline is not None:
                seen[f"off/base_{clock}"] = seen[f"off_{clock}"] / seen[f"base_{clock}"]
                seen[f"base2/base_{clock}"] = seen[f"base2_{clock}"] / seen[f"base_{clock}"]
            seen[f"on/off_{clock}"] = seen[f"on_{clock}"] / seen[f"off_{clock}"]
        figures[kind] = seen
    return figures


def picture(png: str, size_gb: float, budget: str) -> dict[str, Any]:
    """Profile the 4 GB pipeline (module docstring, 2) and save its plot as ``png``."""
    from _harness import ensure_warm, make_npy

    import tierflow as tw

    rows = int(size_gb * GB) // (8 * 4)
    with tempfile.TemporaryDirectory(prefix="tierflow-bench-profile-") as folder:
        path = Path(folder) / "x.npy"
        make_npy(path, rows, 8)
        ensure_warm(path)
        tw.memory.budget(budget)
        x = tw.from_npy(path)
        with tw.profile() as p:
            mean, std = tw.compute(x.mean(axis=0), x.std(axis=0), progress=False)
            ((x - mean) / std).to_npy(Path(folder) / "z.npy", progress=False)
        fig = p.plot(width=10)
        fig.savefig(png, dpi=80)
        s = p.summary()
    return {
        "png": png,
        "png_bytes": os.path.getsize(png),
        "rows": rows,
        "budget": budget,
        "tasks": s.tasks,
        "seconds": round(s.seconds, 2),
        "stages": {k: round(v, 2) for k, v in s.stages.items()},
        "peak_rss_gb": round(s.peak_rss / 2**30, 2),
        "peak_ram_held_gb": round(s.peak_held["RAM"] / 2**30, 2),
        "bytes_spilled": s.bytes_spilled,
    }


@pytest.mark.parametrize("kind", WORKLOADS)
def test_profiling_on_against_off(benchmark: Any, kind: str) -> None:
    off, _ = best_of(kind, False, runs=3, scale=0.05)
    on, _ = benchmark.pedantic(best_of, args=(kind, True, 3, 0.05), rounds=1, iterations=1)
    benchmark.extra_info.update(off_s=off, on_s=on, on_over_off=on / off)
    assert on > 0 and off > 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=WORKLOADS)
    parser.add_argument("--on", action="store_true")
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--picture")
    parser.add_argument("--size-gb", type=float, default=4.0)
    parser.add_argument("--budget", default="1GB")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.on)
        return
    if args.picture:
        print(json.dumps(picture(args.picture, args.size_gb, args.budget), indent=2))
        return
    print(json.dumps(overhead(args.baseline, args.repeat), indent=2))


if __name__ == "__main__":
    main()
