"""External sorts on clusters: where the runs go, and a sort bigger than the nodes' budgets.

1. **Object storage against a shared folder for the runs** (``--part objects``): a
   2-worker Dask cluster on this machine (one thread each, each worker with a spill
   folder of its own) sorts the rows of a float32 ``[rows, 8]`` file by column 0 into a
   new ``.npy`` (``tw.sort_rows(x, by=0).to_npy(dst)``), with ``shared_dir`` a folder,
   then an S3 prefix on a local S3 server (moto's server, in a process of its own).
   The first pass's tasks write one run each there, the merge tasks read their slices
   back with ranged reads. Rounds alternate the two; the ratio is of medians.
2. **4 GB on a two-node Ray cluster, each node with a 1 GB budget** (``--part ray``):
   ``ray.cluster_utils.Cluster`` with two nodes of 1 CPU each, started with
   ``TIERFLOW_RAM_BUDGET=1GB`` and spill folders of their own, a shared folder for
   the runs; the same sort of a 4 GB file, against the same sort on local threads with
   a 2 GB budget (the two nodes' memory together). The peak RSS of every Ray worker
   process is sampled every 50 ms.

Each output is checked (column 0 equals ``np.sort`` of the input's, every column sums as
the input's). Ratios are of one run::

    flock /tmp/tierflow-bench.lock .venv/bin/python tests/benchmarks/bench_cluster_sort.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests/: common.py

from _harness import make_npy  # noqa: E402
from bench_sort import check_output  # noqa: E402

from common import local_s3, separate_disk_cluster  # noqa: E402

WIDTH = 8
ROWS_PER_GB = 31_250_000  # float32 x 8 columns: 10^9 bytes
BUCKET = "bench"


def part_objects(folder: Path, gb: float, rounds: int) -> dict[str, Any]:
    import tierflow as tw
    from tierflow import config

    src = make_npy(folder / "x.npy", int(ROWS_PER_GB * gb), WIDTH)
    x = tw.from_npy(src)
    times: dict[str, list[float]] = {"folder": [], "s3": []}
    spills = [folder / f"spill-{i}" for i in range(2)]
    with local_s3(BUCKET, own_process=True) as options, separate_disk_cluster(spills) as client:
        executor = tw.DaskExecutor(client)
        places = {"folder": str(folder / "shared"), "s3": f"s3://{BUCKET}/runs"}
        try:
            for r in range(rounds):
                for name, place in places.items():
                    config.set(shared_dir=place, shared_options=options)
                    dst = folder / "out.npy"
                    start = time.perf_counter()
                    tw.sort_rows(x, by=0).to_npy(dst, executor=executor, progress=False)
                    times[name].append(time.perf_counter() - start)
                    if r == 0:
                        check_output(src, dst)
                    dst.unlink()
                    print(f"   round {r + 1}, runs in {name}: {times[name][-1]:.2f} s", flush=True)
        finally:
            executor.close()
    folder_s, s3_s = statistics.median(times["folder"]), statistics.median(times["s3"])
    print(
        f"1. sort_rows of {gb:g} GB on 2 Dask workers: runs in a shared folder {folder_s:.2f} s, "
        f"in object storage (local S3 server) {s3_s:.2f} s: object storage / folder "
        f"{s3_s / folder_s:.2f}x the time (medians of {rounds}; outputs checked)"
    )
    return {"times": times, "ratio": s3_s / folder_s}


def _ray_workers_rss(peaks: dict[int, int], stop: threading.Event) -> None:
    import psutil

    while not stop.wait(0.05):
        for p in psutil.process_iter(["name", "cmdline"]):
            try:
                name = " ".join(p.info["cmdline"] or [p.info["name"] or ""])
                if name.startswith("ray::") or "default_worker.py" in name:
                    peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue


def part_ray(folder: Path, gb: float) -> dict[str, Any]:
    import ray
    from ray.cluster_utils import Cluster

    import tierflow as tw
    from tierflow import config
    from tierflow.engine.runtime.executors.cluster import node_budget

    src = make_npy(folder / "x.npy", int(ROWS_PER_GB * gb), WIDTH)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    (folder / "shared").mkdir()
    config.set(shared_dir=str(folder / "shared"))
    before = dict(os.environ)
    os.environ["TIERFLOW_RAM_BUDGET"] = "1GB"  # a node's processes inherit it
    os.environ["TIERFLOW_SPILL_DIR"] = str(folder / "spill-a")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    os.environ["TIERFLOW_SPILL_DIR"] = str(folder / "spill-b")
    cluster.add_node(num_cpus=1)
    os.environ.clear()
    os.environ.update(before)
    os.environ["TIERFLOW_SPILL_DIR"] = str(folder / "spill-driver")
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        budgets = sorted(
            ray.get(
                [ray.remote(num_cpus=1)(lambda: node_budget(None, 1)).remote() for _ in range(4)]
            )
        )
        x = tw.from_npy(src)
        peaks: dict[int, int] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=_ray_workers_rss, args=(peaks, stop), daemon=True)
        sampler.start()
        start = time.perf_counter()
        tw.sort_rows(x, by=0).to_npy(folder / "ray.npy", executor="ray", progress=False)
        on_ray = time.perf_counter() - start
        stop.set()
        sampler.join()
        check_output(src, folder / "ray.npy")
        (folder / "ray.npy").unlink()
        with config.set(ram_budget=2 << 30):
            start = time.perf_counter()
            tw.sort_rows(x, by=0).to_npy(folder / "local.npy", executor="threads", progress=False)
            local = time.perf_counter() - start
        check_output(src, folder / "local.npy")
    finally:
        ray.shutdown()
        cluster.shutdown()
    top = max(peaks.values(), default=0)
    print(
        f"2. sort_rows of {gb:g} GB on two Ray nodes of 1 CPU, budgets {budgets[0] >> 20}-"
        f"{budgets[-1] >> 20} MB per worker: {on_ray:.1f} s; on local threads with a 2 GB "
        f"budget {local:.1f} s: Ray / local {on_ray / local:.2f}x the time; peak RSS of a Ray "
        f"worker {top >> 20} MB ({len(peaks)} worker processes); outputs checked"
    )
    return {"ray": on_ray, "local": local, "budgets": budgets, "peak_rss": top}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["objects", "ray", "both"], default="both")
    parser.add_argument("--objects-gb", type=float, default=1.0)
    parser.add_argument("--ray-gb", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.part == "both":  # one process per part: one Ray per process
        for part in ("objects", "ray"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--part", part]
            subprocess.run(cmd, check=False)
        return
    folder = Path(tempfile.mkdtemp(prefix="bench-cluster-sort-", dir="/tmp"))
    try:
        if args.part == "objects":
            figures = part_objects(folder, args.objects_gb, args.rounds)
        else:
            figures = part_ray(folder, args.ray_gb)
        if args.json:
            Path(args.json).write_text(json.dumps(figures))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
